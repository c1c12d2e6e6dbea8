"""PT2E quantization with ExecuTorch's QnnQuantizer, calibration, and the weight-rounding and
mixed-precision tools around it."""
