"""A reward with known all-equal groups, for the dynamic-sampling end-to-end test.

Prompts whose answer symbol has an even code point score 1.0 on every sample (an all-correct group: no signal); the others
score the parity of the response's first character, which a random model's samples split on (signal).
So about half the groups of a round carry signal and steps need extra generation rounds."""


def score(response, ground_truth, data_source=None, extra=None):
    if ord(str(ground_truth).strip()[:1] or "0") % 2 == 0:
        return 1.0
    return float(ord(response[0]) % 2) if response else 0.0
