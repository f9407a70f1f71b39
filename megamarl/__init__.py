"""megamarl: multi-agent RL for teams of LLM agents on Megatron-core worker groups."""

import warnings

__version__ = "0.1.0"

# Start-up noise from our dependencies that says nothing a user can act on (printed by every rank on
# every start): megatron-core's fallbacks when Transformer Engine / Apex / absl are absent (the
# local implementations are what megamarl uses on CPU) and a vLLM deprecation warning.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "full scope is deprecated",
    "`torch.distributed.reduce_op` is deprecated",
    "Mismatch dtype between input and weight",  # bf16 autocast into fp32 norm weights: unfused path
    # megatron-core's optimizer probes hasattr(param, "main_grad") on every parameter each step
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    # megatron-core's distributed optimizer calls torch's old collective names, each step
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
):
    warnings.filterwarnings("ignore", message=f".*{_message}")
