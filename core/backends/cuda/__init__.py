"""The CUDA backend: Triton paged attention (`triton_attention.py`), a lean Llama forward (`forward.py`) and the
backend over them with its CUDA graphs (`backend.py`)."""
