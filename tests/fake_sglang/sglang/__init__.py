"""A stand-in ``sglang`` package for tests on machines that cannot run SGLang (CPU only).

Only ``python -m sglang.launch_server`` exists: it starts ``FakeSGLangServer`` (tests/fake_servers.py)
(SGLang's HTTP protocol, backed by transformers). Tests put ``tests/fake_sglang`` on ``PYTHONPATH``;
nothing else imports it.
"""

FAKE = True
