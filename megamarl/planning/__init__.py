"""Planning a run before it starts: ``dryrun`` (placement, groups and memory for a declared cluster,
``scripts/train.py --dry-run``) and ``model_presets`` (the shapes of well-known models it uses)."""
