def word_count(text):
    """The number of whitespace-separated words in text."""
    return len(text.split())
