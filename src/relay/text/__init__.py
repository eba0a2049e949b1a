"""Text: tokenizer, incremental detokenizer and grammar-constrained decoding."""
