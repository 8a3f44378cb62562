"""The CPU backend: conveyor's C++ kernels (`kernels.py` builds `csrc/`), the fused Llama forward
(`fused_llama.py`) and the backend over them (`backend.py`)."""
