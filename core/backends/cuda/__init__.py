"""The CUDA backend: Triton paged attention (`triton_attention.py`), a lean forward of the decoder families (`forward.py`) and the
backend over them with its CUDA graphs (`backend.py`)."""
