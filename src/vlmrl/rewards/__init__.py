"""What an answer looks like and what it is worth. The answer format (`answer_format`) is the
contract between the prompt, the SFT targets, the scorer and the rewards; the scorer (`scoring`,
MathVista's rules) decides what is right for evaluation and RL alike; the reward functions
(`functions`, and `text` for free-text answers) are TRL-shaped `f(completions, **columns)` in one
registry. No torch at import: the playground and `vlmrl pull` import this package."""
