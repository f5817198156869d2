"""A batch of 8 rows with every sampling stage (temperatures, top-k/p, min-p, penalties,
logit bias, logprobs, seeds), shared by test_speculative and test_draft_head: their plain
runs at these shapes are one program in the session's compilation cache."""

from jaxinfer.sampling import SamplingParams

MIXED = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
         SamplingParams(temperature=1.0, top_k=20, top_p=0.9, logprobs=True),
         SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=123,
                        logit_bias={5: 3.0, 11: -100}),
         SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.4,
                        logprobs=True),
         SamplingParams(temperature=0.6, min_p=0.05, logit_bias={7: 2.5}),
         SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=True),
         SamplingParams(temperature=1.2, seed=7)]
