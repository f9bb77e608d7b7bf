"""Real prompts the tools use on any model: the quantized graphs' top-1 agreement at export (teacher-forced on the
fp32 model's own greedy continuation, so the positions look like generation) and `specexport profile`'s default
calibration. Disjoint from benchmarks/prompts/*.jsonl."""

AGREEMENT_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarise the plot of Romeo and Juliet.",
    "What are three tips for staying focused while studying?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Give me a recipe for a simple tomato pasta.",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "List the planets of the solar system in order from the sun.",
    "Rewrite this sentence to be more formal: hey, can u send me the report asap?",
    "What is the difference between a list and a tuple in Python?",
]
AGREEMENT_NEW_TOKENS = 48
