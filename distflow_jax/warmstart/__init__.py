"""Warm starts and supervised fine-tuning: the SFT loop (``sft``) and its data
(``sft_data``), the built-in model's warm start on a built-in task (``text``) and the tiny
vision-language model's (``vl``).  It may import observe/, persist/, state/ and the layers
below them; never run/ or the commands.
"""
