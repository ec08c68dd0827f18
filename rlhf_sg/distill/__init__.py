"""On-policy distillation: the teacher group scores the policy's sampled tokens, and each token's advantage gets
the teacher's log-ratio (:func:`rlhf_sg.algorithms.distill_advantages`). Here: the pre-flight check that the teacher
reads the policy's token ids as the policy does (:mod:`.tokenizer_check`)."""

from rlhf_sg.distill.tokenizer_check import check_teacher, padded_vocab_size, tokenizer_differences

__all__ = ["check_teacher", "padded_vocab_size", "tokenizer_differences"]
