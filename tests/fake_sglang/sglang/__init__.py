"""A stand-in ``sglang`` package for tests on machines that cannot run SGLang (CPU only).

Only ``python -m sglang.launch_server`` exists: it starts ``megamarl.rollout.fakes.FakeSGLangServer``
(SGLang's HTTP protocol, backed by transformers). Tests put ``tests/fake_sglang`` on ``PYTHONPATH``;
nothing else imports it.
"""

FAKE = True
