"""The launch layer, above the runtime: what a command does before (or instead of) the trainer —
load and check the config (``configure``), the launch's pre-flight checks and one-line config error
(``front_door``), the dry-run command (``dry_run_command``), the export command (``export``).
"""
