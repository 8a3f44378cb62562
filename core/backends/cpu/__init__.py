"""The CPU backend: conveyor's C++ kernels (`kernels.py` builds `csrc/`), their exact linears (`linears.py`), the
fused forward of the decoder families (`fused_decoder.py`) and the backend over them (`backend.py`)."""
