import sys

from slugify import slugify
from wordcount import word_count

USAGE = "usage: textkit slug TEXT | textkit count FILE"


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "slug":
        print(slugify(args[1]))
        return 0
    if len(args) == 2 and args[0] == "count":
        with open(args[1]) as handle:
            print(word_count(handle.read()))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
