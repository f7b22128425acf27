import os
import sys

# The tiny random models and byte tokenizer of the core test suite.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
