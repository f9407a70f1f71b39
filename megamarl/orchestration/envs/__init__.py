"""Built-in environments; importing this package registers them in ``ENVS`` (and their agent
kinds in ``AGENTS``)."""

from megamarl.orchestration.envs import code, math, planning, search, signalling, sudoku  # noqa: F401
