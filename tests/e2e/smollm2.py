"""The gateway's `estimation` settings for pools of the SmolLM2 CPU test engine (`gateway/llamacpp_worker`).

Tokens per character measured through the engine's own `/tokenize` with
`python -m loadtest.estimate_calibration --engine smollm2` (README "Prompt-token estimate"), the fit
that errs high on every sample, rounded up. SmolLM2's 49K English-centric vocabulary spends about
2 tokens on a CJK ideograph and 2.7 on a hangul syllable, 3x what Qwen's 151K vocabulary spends.
"""

SMOLLM2_ESTIMATION: dict[str, object] = {
    "text_rates": {"latin": 0.26, "digit": 1.01, "whitespace": 0.29, "punctuation": 0.73, "han": 1.96,
                   "kana": 1.86, "hangul": 2.75, "cjk_punctuation": 1.19},
    "bytes_per_token": 2.3,
}
