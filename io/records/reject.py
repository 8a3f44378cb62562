"""Reject: what the steps that turn a record into a request raise when the record cannot be used.

Its message says what is wrong and what to do, naming the field at fault, but not where the record is: the
RequestBuilder puts the record's location in front and makes the message the record's error row. Pure Python.
"""


class Reject(Exception):
    """The record cannot be used; the message says why and what to do (no location)."""
