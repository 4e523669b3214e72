"""Triton kernels (installed as ``linearize.kernels``).

Each op lives in its own folder with the Triton code, the autograd wrapper and a readable
PyTorch reference: ``linear_attn`` (normalized feature-map linear attention) and
``gated_delta`` (the gated delta rule). Layers import them lazily and fall back to the
PyTorch path on CPU unless ``TRITON_INTERPRET=1``.
"""
