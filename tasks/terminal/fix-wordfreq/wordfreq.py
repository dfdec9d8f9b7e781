#!/usr/bin/env python3
"""Print the most frequent words of a text file.

usage: wordfreq.py FILE [-n N]
"""

import argparse
from collections import Counter


def count_words(text):
    counts = Counter()
    for word in text.split():
        counts[word] += 1
    return counts


def top_words(counts, n):
    ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]), reverse=True)
    return ranked[: n - 1]


def main():
    parser = argparse.ArgumentParser(description="most frequent words")
    parser.add_argument("file")
    parser.add_argument("-n", type=int, default=10)
    args = parser.parse_args()
    with open(args.file) as handle:
        counts = count_words(handle.read())
    for word, count in top_words(counts, args.n):
        print(word, count)


if __name__ == "__main__":
    main()
