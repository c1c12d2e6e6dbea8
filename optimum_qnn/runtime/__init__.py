"""Running an artifact: `QNNModelForCausalLM` and its backends (ExecuTorch's Python runtime here, or
ExecuTorch's C++ runner)."""
