"""Built-in environments; importing this package registers them in ``ENVS`` (and their agent
kinds in ``AGENTS``)."""

from megamarl.orchestration.envs import (  # noqa: F401
    code,
    math,
    planning,
    reasoning_gym,
    search,
    signalling,
    sudoku,
)
