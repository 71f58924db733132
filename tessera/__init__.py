"""tessera: an optimizer toolchain for deep-learning models given as ONNX files."""

__version__ = "0.1.0"
