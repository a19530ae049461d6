"""Bisection algorithms."""


def insort_right(a, x, low=0, high=None, *, key=None):
    """Insert item x in list a, and keep it sorted assuming a is sorted.

    If x is already in a, insert it to the right of the rightmost x.

    Optional args low (default 0) and high (default len(a)) bound the
    slice of a to be searched.
    """
    if key is None:
        low = bisect_right(a, x, low, high)
    else:
        low = bisect_right(a, key(x), low, high, key=key)
    a.insert(low, x)


def bisect_right(a, x, low=0, high=None, *, key=None):
    """Return the index where to insert item x in list a, assuming a is sorted.

    The return value i is such that all e in a[:i] have e <= x, and all e in
    a[i:] have e > x.  So if x already appears in the list, a.insert(i, x) will
    insert just after the rightmost x already there.

    Optional args low (default 0) and high (default len(a)) bound the
    slice of a to be searched.
    """

    if low < 0:
        raise ValueError('low must be non-negative')
    if high is None:
        high = len(a)
    # Note, the comparison uses "<" to match the
    # __lt__() logic in list.sort() and in heapq.
    if key is None:
        while low < high:
            mid = (low + high) // 2
            if x < a[mid]:
                high = mid
            else:
                low = mid + 1
    else:
        while low < high:
            mid = (low + high) // 2
            if x < key(a[mid]):
                high = mid
            else:
                low = mid + 1
    return low


def insort_left(a, x, low=0, high=None, *, key=None):
    """Insert item x in list a, and keep it sorted assuming a is sorted.

    If x is already in a, insert it to the left of the leftmost x.

    Optional args low (default 0) and high (default len(a)) bound the
    slice of a to be searched.
    """

    if key is None:
        low = bisect_left(a, x, low, high)
    else:
        low = bisect_left(a, key(x), low, high, key=key)
    a.insert(low, x)

def bisect_left(a, x, low=0, high=None, *, key=None):
    """Return the index where to insert item x in list a, assuming a is sorted.

    The return value i is such that all e in a[:i] have e < x, and all e in
    a[i:] have e >= x.  So if x already appears in the list, a.insert(i, x) will
    insert just before the leftmost x already there.

    Optional args low (default 0) and high (default len(a)) bound the
    slice of a to be searched.
    """

    if low < 0:
        raise ValueError('low must be non-negative')
    if high is None:
        high = len(a)
    # Note, the comparison uses "<" to match the
    # __lt__() logic in list.sort() and in heapq.
    if key is None:
        while low < high:
            mid = (low + high) // 2
            if a[mid] < x:
                low = mid + 1
            else:
                high = mid
    else:
        while low < high:
            mid = (low + high) // 2
            if key(a[mid]) < x:
                low = mid + 1
            else:
                high = mid
    return low


# Overwrite above definitions with a fast C implementation
try:
    from _bisect import *
except ImportError:
    pass

# Create aliases
bisect = bisect_right
insort = insort_right
