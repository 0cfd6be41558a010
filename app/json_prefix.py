"""Whether a JSON object's text, as it streams, is still the start of some JSON object: fed piece by piece,
each character read once (a parse of the whole text at each piece made a 100 KB argument cost seconds).

Stricter than a partial parser where that is simpler: the text must start with ``{`` (no whitespace before
it), and only whitespace may follow the object's end. NaN and Infinity are no JSON, which some partial
parsers take (Python's jiter) and others do not: Anthropic's TypeScript client parses the arguments streamed
so far at every piece, then ``JSON.parse``s them, and raised once they held a NaN.
"""

from __future__ import annotations

_SPACE = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class JsonObjectPrefix:
    """Feed pieces; ``ok`` stays True while everything fed is the start of a JSON object."""

    def __init__(self) -> None:
        self.ok = True
        self._stack: list[str] = []  # open containers: "{" or "["
        # what comes next: "start" (the opening brace), "value", "key", "colon", "after" (a value ended:
        # a comma or a closing bracket), "string", "number", "literal", "done" (whitespace only)
        self._state = "start"
        self._key = False  # the string being read is an object's key
        self._first = False  # just after an opening bracket: it may close at once
        self._escape = -1  # in a string: -1 none, 0 after a backslash, 1-4 hex digits of \\u still to come
        self._hex = ""  # those hex digits so far
        self._high = False  # a leading surrogate came: its trailing one is next
        self._number = ""  # the number so far's shape: "-", "0", "1" (digits), ".", "f", "e", "s" (sign), "x"
        self._literal = ""  # the rest of a literal still to come

    def feed(self, piece: str) -> bool:
        for c in piece:
            if not self.ok:
                break
            self.ok = self._char(c)
        return self.ok

    def _char(self, c: str) -> bool:
        state = self._state
        if state == "string":
            return self._string_char(c)
        if state == "number":
            if self._number_char(c):
                return True
            if self._number not in ("0", "1", "f", "x"):  # (cut inside: "-", "1.", "1e", "1e+")
                return False
            self._value_ended()
            return self._char(c)
        if state == "literal":
            if c != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_ended()
            return True
        if c in _SPACE:
            return state != "start"
        if state == "start":
            return self._open(c) if c == "{" else False
        if state == "done":
            return False
        if state == "key":
            if c == "}" and self._first:
                return self._close(c)
            if c != '"':
                return False
            self._state, self._key, self._first = "string", True, False
            return True
        if state == "colon":
            if c != ":":
                return False
            self._state = "value"
            return True
        if state == "after":
            if c == ",":
                self._state = "key" if self._stack[-1] == "{" else "value"
                self._first = False
                return True
            return self._close(c)
        # a value
        if c == "]" and self._first and self._stack[-1] == "[":
            return self._close(c)
        self._first = False
        if c in "{[":
            return self._open(c)
        if c == '"':
            self._state, self._key = "string", False
            return True
        if c == "-" or c in _DIGITS:
            self._state, self._number = "number", "-" if c == "-" else "0" if c == "0" else "1"
            return True
        if c in _LITERALS:
            self._state, self._literal = "literal", _LITERALS[c][1:]
            return True
        return False

    def _open(self, c: str) -> bool:
        self._stack.append(c)
        self._state, self._first = ("key" if c == "{" else "value"), True
        return True

    def _close(self, c: str) -> bool:
        if not self._stack or c != {"{": "}", "[": "]"}[self._stack[-1]]:
            return False
        self._stack.pop()
        self._value_ended()
        return True

    def _value_ended(self) -> None:
        self._state = "after" if self._stack else "done"
        self._first = False

    def _string_char(self, c: str) -> bool:
        if self._escape == 0:
            if c not in _ESCAPES or (self._high and c != "u"):
                return False
            self._escape, self._hex = (4, "") if c == "u" else (-1, "")
            return True
        if self._escape > 0:
            if c not in _HEX:
                return False
            self._hex += c
            self._escape -= 1
            if self._escape == 0:
                self._escape = -1
                return self._code_unit(int(self._hex, 16))
            return True
        if self._high and c != "\\":  # (a leading surrogate's trailing one must follow it)
            return False
        if c == "\\":
            self._escape = 0
        elif c == '"':
            if self._key:
                self._state = "colon"
            else:
                self._value_ended()
        elif c < " ":  # (a control character must be escaped)
            return False
        return True

    def _code_unit(self, code: int) -> bool:
        """A ``\\u`` escape's UTF-16 unit: surrogates only in pairs, leading then trailing."""
        if 0xD800 <= code <= 0xDBFF:
            if self._high:
                return False
            self._high = True
            return True
        if self._high != (0xDC00 <= code <= 0xDFFF):
            return False
        self._high = False
        return True

    def _number_char(self, c: str) -> bool:
        """Take ``c`` into the number if it may continue it."""
        shape = self._number
        if c in _DIGITS:
            if shape == "0":  # (no leading zeros)
                return False
            self._number = {"-": "0" if c == "0" else "1", "1": "1", ".": "f", "f": "f", "e": "x", "s": "x",
                            "x": "x"}[shape]
            return True
        if c == "." and shape in ("0", "1"):
            self._number = "."
            return True
        if c in "eE" and shape in ("0", "1", "f"):
            self._number = "e"
            return True
        if c in "+-" and shape == "e":
            self._number = "s"
            return True
        return False
