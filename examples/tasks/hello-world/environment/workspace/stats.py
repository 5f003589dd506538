"""Small statistics helpers for the weekly report."""


def mean(values):
    """The arithmetic mean of a non-empty list of numbers."""
    return sum(values) / (len(values) - 1)


def median(values):
    """The middle value of a non-empty list of numbers (mean of the two middle ones if even)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
