"""The causal-LM loss on answer tokens only: labels of -100 (`IGNORE_INDEX`, the label transformers'
causal-LM loss skips) mark the prompt and the padding, and `shifted_lm_loss` is the shifted cross-entropy
of transformers' causal LMs (`ForCausalLMLoss`). The instruction collator writes the labels
(`hf_fedtask.model.instructions`); a linearized causal LM computes its loss with it
(`hf_fedtask.model.linearize`). torch is imported where it is used: `RunConfig` imports this module
through `hf_fedtask.model.backbone`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # the label transformers' causal-LM loss skips


def shifted_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of (batch, length, vocab) logits: token t predicts label t+1, -100 skipped."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX)
