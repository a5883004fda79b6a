"""`judge`: an LLM scores a group of trajectories relative to each other (ART's RULER), its calls
kept out of training. The prompt: `prompt`; reading the answer: `answer`; the client: `client`."""

from fulmen.rewards.judging.call import JudgeError, judge
from fulmen.rewards.judging.client import JUDGE_HEADER, JUDGE_PURPOSE
from fulmen.rewards.judging.prompt import DEFAULT_RUBRIC

__all__ = ["DEFAULT_RUBRIC", "JUDGE_HEADER", "JUDGE_PURPOSE", "JudgeError", "judge"]
