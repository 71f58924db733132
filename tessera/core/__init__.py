"""Core: graph IR, ONNX loading and extraction, cluster specs, plan schemas, cost model."""
