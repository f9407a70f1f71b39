"""An empty ``common_ops``: ``sgl_kernel`` (SGLang's kernel wrappers) imports its compiled ops from
``sgl_kernel/common_ops.*.so`` and, failing that, from a top-level ``common_ops`` module. PyPI has no
CPU build of those ops; with ``SGLANG_USE_CPU_ENGINE=1`` SGLang takes its plain-PyTorch paths and
never calls them, so an importable module is all ``import sgl_kernel`` needs."""
