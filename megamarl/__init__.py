"""megamarl: multi-agent RL for teams of LLM agents on Megatron-core worker groups."""

__version__ = "0.1.0"
