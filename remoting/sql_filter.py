"""RocketMQ's SQL92 message selector (``MessageSelector.bySql``): parsed once, evaluated on a message's properties.

It lives here because both ends need it: the broker evaluates it on every candidate message of a pull, and the
client parses the same expression when it subscribes, so a typo fails there and not in every pull.

The grammar and the semantics are those of RocketMQ 5's filter module (``SelectorParser.jj``, which RocketMQ took
from ActiveMQ's JMS selectors), so an expression selects here what it selects on a RocketMQ broker::

    expression := or
    or         := and ('OR' and)*
    and        := equality ('AND' equality)*
    equality   := comparison ('=' comparison | '<>' comparison | 'IS' ['NOT'] 'NULL')*
    comparison := unary ( ('>' | '>=' | '<' | '<=') unary
                        | ['NOT'] 'BETWEEN' unary 'AND' unary
                        | ['NOT'] 'IN' '(' string (',' string)* ')'
                        | ['NOT'] ('CONTAINS' | 'STARTSWITH' | 'ENDSWITH') string )*
    unary      := '+' unary | '-' unary | 'NOT' unary | primary
    primary    := literal | property | '(' or ')'

Keywords are case-insensitive. A property is ``[A-Za-z_$][A-Za-z0-9_$]*`` and names a message property (``TAGS`` is
the tag, as RocketMQ stores it). Literals: 'strings' ('' is a quote), integers (an ``L`` suffix allowed; a Java int,
a long beyond 32 bits), decimals (``3.14``, ``.5``, ``1e3``: doubles), TRUE, FALSE, NULL. ``--`` and ``/* */``
comments. Note that NOT binds tighter than a comparison, as in RocketMQ: write ``NOT (a = 'x')``.

Evaluation, as RocketMQ's:

- A property is a string, or NULL when the message does not have it. Compared with a number it is read as that
  number's type: Java's ``Integer.valueOf`` for an int literal, ``Long.valueOf`` for a long, ``Double.valueOf`` for a
  decimal (so ``a > 5`` on a = '5.5' cannot read it: write ``a > 5.0``). Two properties compared by ``<`` ``>`` are
  both read as doubles. ``a = TRUE`` reads a as a boolean: 'true' in any case is TRUE, any other text FALSE.
- A value that cannot be read is an evaluation error, and an error anywhere makes the whole expression not match
  that message (RocketMQ's evaluation throws and its broker does not deliver the message): ``a > 5 OR b = 1`` does
  not match a message whose a is 'abc', whatever its b.
- NULL makes a comparison unknown: ``=``, ``<>``, ``<`` ``<=`` ``>`` ``>=``, BETWEEN, IN and NOT IN with a missing
  property are all unknown, NOT unknown is unknown, AND and OR are three-valued (unknown AND FALSE is FALSE, unknown
  OR TRUE is TRUE), and a message matches only when the whole expression is TRUE. IS [NOT] NULL is never unknown,
  nor are CONTAINS, STARTSWITH, ENDSWITH and their NOT forms: FALSE for a missing property, and for an empty search
  string. One asymmetry is RocketMQ's too: ``'x' = a`` with a missing is FALSE, not unknown.

What the parser refuses, as RocketMQ's: a string, boolean or NULL literal, or a condition, on either side of ``<``
``<=`` ``>`` ``>=``; NULL on either side of ``=`` or ``<>`` (write IS NULL); IN after anything but a property; a
BETWEEN whose two literal bounds are NULL or in the wrong order; a literal or arithmetic where a condition is
wanted. One difference: RocketMQ refuses decimal literals below ``Double.MIN_VALUE``, 0.0 among them (an
oversight there); they are taken here.

Each expression is compiled once (``compile_sql``, cached) into nested closures. Input is bounded: at most
``MAX_SQL_EXPRESSION_LENGTH`` characters (the tag expression's bound, both travel in the same request field) and
``MAX_DEPTH`` levels of nesting, so that neither parsing nor evaluation can run out of stack; a chain of AND or OR
is flat, however long.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from remoting.message import MAX_TAG_EXPRESSION_LENGTH

__all__ = ["EXPRESSION_TYPES", "MAX_DEPTH", "MAX_SQL_EXPRESSION_LENGTH", "SQL92", "TAG", "SqlEvaluationError",
           "SqlFilter", "SqlFilterError", "compile_sql"]

# The values of a subscription's ``expression_type`` (RocketMQ's ExpressionType); absent or empty means TAG.
TAG = "TAG"
SQL92 = "SQL92"
EXPRESSION_TYPES = (TAG, SQL92)

MAX_SQL_EXPRESSION_LENGTH = MAX_TAG_EXPRESSION_LENGTH
MAX_DEPTH = 64  # nesting levels: parentheses, NOT, signs, and operators applied to results of operators

_INT_RANGE = (-(2 ** 31), 2 ** 31 - 1)
_LONG_RANGE = (-(2 ** 63), 2 ** 63 - 1)


class SqlFilterError(ValueError):
    """An expression that cannot be used; ``position`` is the 0-based index of the offending character (None when
    the fault is the whole expression's: its type or its length)."""

    def __init__(self, problem: str, expression: str, position: int | None) -> None:
        where = ""
        if position is not None:
            near = expression[position:position + 24]
            where = f" at character {position + 1}" + (f" (near {near!r})" if near else " (its end)")
        super().__init__(f"SQL92 expression: {problem}{where}")
        self.problem = problem
        self.expression = expression
        self.position = position


class SqlEvaluationError(ValueError):
    """A message's property could not be read as the expression wants it (the message does not match)."""


# --- values ----------------------------------------------------------------------------------------------------
# Every expression has a static kind, from which the Java class of its value follows (or NULL): a property is a
# String, a literal its own class, a condition a Boolean. So every conversion RocketMQ decides at run time from the
# classes of the two values is chosen here once, when the expression is compiled.
_STRING, _INT, _LONG, _DOUBLE, _BOOL, _NULL = "String", "Integer", "Long", "Double", "Boolean", "null"

_JAVA_INTEGER = re.compile(r"[+-]?[0-9]+")
# Java's Double.valueOf: surrounding control characters and spaces ignored, a type suffix allowed.
_JAVA_DOUBLE = re.compile(r"[+-]?(?:NaN|Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[fFdD]?)")
_JAVA_TRIM = "".join(chr(c) for c in range(0x21))


def _read_int(text: str, java_type: str, bounds: tuple[int, int]) -> int:
    if _JAVA_INTEGER.fullmatch(text):
        # No long has more than 19 digits past its leading zeros, and int() of a text of thousands of digits raises
        # ValueError (CPython's conversion limit): a property of 5,000 nines made every pull of its queue fail.
        digits = text.lstrip("+-").lstrip("0") or "0"
        if len(digits) <= 19:
            value = -int(digits) if text[0] == "-" else int(digits)
            if bounds[0] <= value <= bounds[1]:
                return value
    raise SqlEvaluationError(f"{text[:40]!r} is not a Java {java_type}")


def _read_java_int(text: str) -> int:
    return _read_int(text, "int", _INT_RANGE)


def _read_java_long(text: str) -> int:
    return _read_int(text, "long", _LONG_RANGE)


def _read_java_double(text: str) -> float:
    text = text.strip(_JAVA_TRIM)
    if not _JAVA_DOUBLE.fullmatch(text):
        raise SqlEvaluationError(f"{text[:40]!r} is not a number")
    if text[-1] in "fFdD":
        text = text[:-1]
    return float(text)


def _read_java_boolean(text: str) -> bool:
    return text.lower() == "true"


def _cmp(a: Any, b: Any) -> int:
    return (a > b) - (a < b)


def _cmp_double(a: float, b: float) -> int:
    """Java's Double.compare: NaN above everything and equal to itself, -0.0 below 0.0."""
    if a < b:
        return -1
    if a > b:
        return 1
    a_nan, b_nan = a != a, b != b
    if a_nan or b_nan:
        return a_nan - b_nan
    return _cmp(math.copysign(1.0, a), math.copysign(1.0, b))


def _minus_one(a: Any, b: Any) -> int:
    return -1  # RocketMQ's __compare for classes it cannot convert between: "less", so never equal


def _class_cast(a: Any, b: Any) -> int:
    # RocketMQ's __compare casts the Boolean to String here and the evaluation fails.
    raise SqlEvaluationError("a boolean cannot be compared with a string")


def _comparator(left: str, right: str) -> Callable[[Any, Any], int]:
    """RocketMQ's ``ComparisonExpression.__compare`` (with string conversion on) for values of these classes."""
    if left == right:
        return _cmp_double if left == _DOUBLE else _cmp
    if left == _BOOL:
        return _class_cast if right == _STRING else _minus_one
    if left in (_INT, _LONG):
        if right in (_INT, _LONG):
            return _cmp
        if right == _DOUBLE:
            return lambda a, b: _cmp_double(float(a), b)
        if right == _STRING:
            read = _read_java_int if left == _INT else _read_java_long
            return lambda a, b: _cmp(a, read(b))
        return _minus_one
    if left == _DOUBLE:
        if right in (_INT, _LONG):
            return lambda a, b: _cmp_double(a, float(b))
        if right == _STRING:
            return lambda a, b: _cmp_double(a, _read_java_double(b))
        return _minus_one
    # left is a String
    if right == _BOOL:
        return lambda a, b: _cmp(_read_java_boolean(a), b)
    if right == _INT:
        return lambda a, b: _cmp(_read_java_int(a), b)
    if right == _LONG:
        return lambda a, b: _cmp(_read_java_long(a), b)
    if right == _DOUBLE:
        return lambda a, b: _cmp_double(_read_java_double(a), b)
    return _minus_one


# --- expressions -----------------------------------------------------------------------------------------------
Props = Mapping[str, str]
Fn = Callable[[Props], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class _Expr:
    fn: Fn  # props -> value (None is NULL / unknown)
    java: str  # the class of a non-NULL value: _STRING, _INT, ...
    pos: int  # where it starts in the expression
    depth: int = 1
    condition: bool = False  # RocketMQ's BooleanExpression: conditions, TRUE, FALSE and NULL
    literal: bool = False  # RocketMQ's ConstantExpression (a signed number is not one)
    value: Any = None  # a literal's value
    prop: str | None = None  # the property a PropertyExpression names


def _constant(value: Any) -> Fn:
    return lambda props: value


class _Parser:
    def __init__(self, expression: str) -> None:
        self.text = expression
        self.tokens = _tokenize(expression)
        self.i = 0
        self.nesting = 0

    # -- tokens --
    def peek(self, ahead: int = 0) -> tuple[str, Any, int]:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def at(self, value: str) -> bool:
        """Whether the next token is the keyword or operator ``value``."""
        kind, current, _ = self.peek()
        return kind in ("KW", "OP") and current == value

    def take(self) -> tuple[str, Any, int]:
        token = self.tokens[self.i]
        if token[0] != "EOF":
            self.i += 1
        return token

    def expect(self, value: str, what: str) -> tuple[str, Any, int]:
        token = self.peek()
        if token[0] in ("KW", "OP") and token[1] == value:
            return self.take()
        raise self.error(f"expected {what}, found {_describe(token)}", token[2])

    def error(self, problem: str, pos: int) -> SqlFilterError:
        return SqlFilterError(problem, self.text, pos)

    def deeper(self, expr: _Expr, *children: _Expr, at: int | None = None) -> _Expr:
        """``expr`` with its depth, refused past MAX_DEPTH (``at``: the operator's position, else expr's)."""
        depth = 1 + max(c.depth for c in children)
        if depth > MAX_DEPTH:
            raise self.error(f"the expression nests deeper than {MAX_DEPTH} levels", expr.pos if at is None else at)
        return dataclasses.replace(expr, depth=depth)

    # -- grammar --
    def parse(self) -> _Expr:
        expr = self.condition(self.or_expression())
        token = self.peek()
        if token[0] != "EOF":
            raise self.error(f"unexpected {_describe(token)}", token[2])
        return expr

    def or_expression(self) -> _Expr:
        first = self.and_expression()
        parts = [first]
        while self.at("OR"):
            self.take()
            parts.append(self.condition(self.and_expression()))
        if len(parts) == 1:
            return first
        parts[0] = self.condition(first)
        return self.deeper(_Expr(_any_of(tuple(p.fn for p in parts)), _BOOL, first.pos, condition=True), *parts)

    def and_expression(self) -> _Expr:
        first = self.equality_expression()
        parts = [first]
        while self.at("AND"):
            self.take()
            parts.append(self.condition(self.equality_expression()))
        if len(parts) == 1:
            return first
        parts[0] = self.condition(first)
        return self.deeper(_Expr(_all_of(tuple(p.fn for p in parts)), _BOOL, first.pos, condition=True), *parts)

    def equality_expression(self) -> _Expr:
        left = self.comparison_expression()
        while True:
            kind, value, pos = self.peek()
            if kind == "OP" and value in ("=", "<>"):
                self.take()
                right = self.comparison_expression()
                left = self.equal(left, right, pos, negate=value == "<>")
            elif kind == "KW" and value == "IS":
                self.take()
                negate = self.at("NOT")
                if negate:
                    self.take()
                self.expect("NULL", "NULL after IS" + (" NOT" if negate else ""))
                left = self.deeper(_Expr(_is_null(left.fn, negate), _BOOL, left.pos, condition=True), left, at=pos)
            else:
                return left

    def comparison_expression(self) -> _Expr:
        left = self.unary_expression()
        while True:
            kind, value, pos = self.peek()
            if kind == "OP" and value in (">", ">=", "<", "<="):
                self.take()
                left = self.compare(left, value, self.unary_expression(), pos)
                continue
            negate = kind == "KW" and value == "NOT" and self.peek(1)[0] == "KW" and self.peek(1)[1] in (
                "BETWEEN", "IN", "CONTAINS", "STARTSWITH", "ENDSWITH")
            if negate:
                self.take()
                kind, value, _ = self.peek()
            if kind != "KW" or value not in ("BETWEEN", "IN", "CONTAINS", "STARTSWITH", "ENDSWITH"):
                return left
            self.take()
            if value == "BETWEEN":
                left = self.between(left, pos, negate)
            elif value == "IN":
                left = self.in_list(left, pos, negate)
            else:
                search = self.string_literal(f"a string after {value}")
                left = self.deeper(_Expr(_text_test(left.fn, left.java, value, search, negate), _BOOL, left.pos,
                                         condition=True), left)

    def unary_expression(self) -> _Expr:
        kind, value, pos = self.peek()
        if (kind == "OP" and value in ("+", "-")) or (kind == "KW" and value == "NOT"):
            self.take()
            self.nesting += 1
            if self.nesting > MAX_DEPTH:
                raise self.error(f"the expression nests deeper than {MAX_DEPTH} levels", pos)
            operand = self.unary_expression()
            self.nesting -= 1
            if value == "+":
                return operand
            if value == "-":
                return self.deeper(_negate(operand, pos), operand)
            operand = self.condition(operand)
            return self.deeper(_Expr(_not(operand.fn), _BOOL, pos, condition=True), operand)
        return self.primary_expression()

    def primary_expression(self) -> _Expr:
        kind, value, pos = self.take()
        if kind == "OP" and value == "(":
            self.nesting += 1
            if self.nesting > MAX_DEPTH:
                raise self.error(f"the expression nests deeper than {MAX_DEPTH} levels", pos)
            inner = self.or_expression()
            self.nesting -= 1
            self.expect(")", "')' closing the '(' at character %d" % (pos + 1))
            return inner
        if kind == "ID":
            return _Expr(_property(value), _STRING, pos, prop=value)
        if kind == "STR":
            return _Expr(_constant(value), _STRING, pos, literal=True, value=value)
        if kind == "NUM":
            java, number = value
            return _Expr(_constant(number), java, pos, literal=True, value=number)
        if kind == "KW" and value in ("TRUE", "FALSE"):
            flag = value == "TRUE"
            return _Expr(_constant(flag), _BOOL, pos, condition=True, literal=True, value=flag)
        if kind == "KW" and value == "NULL":
            return _Expr(_constant(None), _NULL, pos, condition=True, literal=True)
        raise self.error(f"expected a property, a literal or '(', found {_describe((kind, value, pos))}", pos)

    def string_literal(self, what: str) -> str:
        kind, value, pos = self.peek()
        if kind != "STR":
            raise self.error(f"expected {what}, found {_describe((kind, value, pos))}", pos)
        self.take()
        return value

    # -- operators --
    def condition(self, expr: _Expr) -> _Expr:
        """RocketMQ's asBooleanExpression: a condition as it is, a property read as a boolean, anything else
        refused."""
        if expr.condition:
            return expr
        if expr.prop is not None:
            return dataclasses.replace(expr, fn=_boolean_cast(expr.fn), java=_BOOL, condition=True, prop=None)
        raise self.error("this is a value, not a condition (compare it with something)", expr.pos)

    def equal(self, left: _Expr, right: _Expr, pos: int, *, negate: bool) -> _Expr:
        for operand in (left, right):
            if operand.literal and operand.java == _NULL:
                raise self.error("NULL cannot be compared with '=' or '<>' (write IS NULL or IS NOT NULL)",
                                 operand.pos)
        if left.literal and right.literal and left.java == _BOOL and right.java != _BOOL:
            raise self.error(f"{_show(left)} cannot be compared with {_show(right)}", pos)
        fn = _equal(left.fn, right.fn, _comparator(left.java, right.java))
        if negate:
            fn = _not(fn)
        return self.deeper(_Expr(fn, _BOOL, left.pos, condition=True), left, right, at=pos)

    def check_orderable(self, operand: _Expr, op: str, pos: int) -> None:
        # RocketMQ's checkLessThanOperand: only numbers (and properties, read as numbers) are ordered.
        if (operand.literal and operand.java not in (_INT, _LONG, _DOUBLE)) or operand.condition:
            raise self.error(f"{_show(operand)} cannot be compared with {op!r}: only numbers and properties can",
                             operand.pos if operand.literal else pos)

    def compare(self, left: _Expr, op: str, right: _Expr, pos: int) -> _Expr:
        self.check_orderable(left, op, pos)
        self.check_orderable(right, op, pos)
        if left.java == _STRING and right.java == _STRING:
            cmp: Callable[[Any, Any], int] = lambda a, b: _cmp_double(_read_java_double(a), _read_java_double(b))
        else:
            cmp = _comparator(left.java, right.java)
        fn = _order(left.fn, right.fn, cmp, _ORDERS[op])
        return self.deeper(_Expr(fn, _BOOL, left.pos, condition=True), left, right, at=pos)

    def between(self, value: _Expr, pos: int, negate: bool) -> _Expr:
        low = self.unary_expression()
        self.expect("AND", "AND between the two bounds of BETWEEN")
        high = self.unary_expression()
        if not negate and low.literal and high.literal:
            if low.java == _NULL or high.java == _NULL:
                raise self.error("the bounds of BETWEEN cannot be NULL", pos)
            try:
                wrong_order = _comparator(high.java, low.java)(high.value, low.value) < 0
            except SqlEvaluationError as e:
                raise self.error(f"the bounds of BETWEEN cannot be compared: {e}", low.pos) from None
            if wrong_order:
                raise self.error(f"the bounds of BETWEEN must be low AND high: {_show(low)} is above {_show(high)}",
                                 low.pos)
        if negate:
            parts = (self.compare(value, "<", low, pos), self.compare(value, ">", high, pos))
            return self.deeper(_Expr(_any_of(tuple(p.fn for p in parts)), _BOOL, value.pos, condition=True), *parts)
        parts = (self.compare(value, ">=", low, pos), self.compare(value, "<=", high, pos))
        return self.deeper(_Expr(_all_of(tuple(p.fn for p in parts)), _BOOL, value.pos, condition=True), *parts)

    def in_list(self, value: _Expr, pos: int, negate: bool) -> _Expr:
        if value.prop is None:
            raise self.error("IN needs a property on its left", value.pos)
        self.expect("(", "'(' after IN")
        items = [self.string_literal("a string in the IN list")]
        while self.at(","):
            self.take()
            items.append(self.string_literal("a string in the IN list"))
        self.expect(")", "')' closing the IN list")
        return _Expr(_in(value.prop, frozenset(items), negate), _BOOL, value.pos, depth=value.depth + 1,
                     condition=True)


_ORDERS: dict[str, Callable[[int], bool]] = {
    ">": lambda c: c > 0, ">=": lambda c: c >= 0, "<": lambda c: c < 0, "<=": lambda c: c <= 0}


def _property(name: str) -> Fn:
    return lambda props: props.get(name)


def _boolean_cast(fn: Fn) -> Fn:
    def cast(props: Props) -> bool | None:
        return None if fn(props) is None else False  # a property is text, never a Boolean
    return cast


def _not(fn: Fn) -> Fn:
    def negated(props: Props) -> bool | None:
        value = fn(props)
        return None if value is None else not value
    return negated


def _all_of(fns: tuple[Fn, ...]) -> Fn:
    def all_of(props: Props) -> bool | None:
        unknown = False
        for fn in fns:
            value = fn(props)
            if value is False:
                return False
            if value is None:
                unknown = True
        return None if unknown else True
    return all_of


def _any_of(fns: tuple[Fn, ...]) -> Fn:
    def any_of(props: Props) -> bool | None:
        unknown = False
        for fn in fns:
            value = fn(props)
            if value is True:
                return True
            if value is None:
                unknown = True
        return None if unknown else False
    return any_of


def _equal(left: Fn, right: Fn, cmp: Callable[[Any, Any], int]) -> Fn:
    def equal(props: Props) -> bool | None:
        lv, rv = left(props), right(props)
        if lv is None:
            return True if rv is None else None
        if rv is None:
            return False
        return cmp(lv, rv) == 0
    return equal


def _order(left: Fn, right: Fn, cmp: Callable[[Any, Any], int], accept: Callable[[int], bool]) -> Fn:
    def order(props: Props) -> bool | None:
        lv = left(props)
        if lv is None:
            return None
        rv = right(props)
        if rv is None:
            return None
        return accept(cmp(lv, rv))
    return order


def _is_null(fn: Fn, negate: bool) -> Fn:
    if negate:
        return lambda props: fn(props) is not None
    return lambda props: fn(props) is None


def _in(name: str, items: frozenset[str], negate: bool) -> Fn:
    def in_list(props: Props) -> bool | None:
        value = props.get(name)
        if value is None:
            return None
        return (value in items) != negate
    return in_list


_TEXT_TESTS: dict[str, Callable[[str, str], bool]] = {
    "CONTAINS": lambda text, search: search in text,
    "STARTSWITH": str.startswith,
    "ENDSWITH": str.endswith,
}


def _text_test(fn: Fn, java: str, op: str, search: str, negate: bool) -> Fn:
    test = _TEXT_TESTS[op]
    is_text = java == _STRING

    def text_test(props: Props) -> bool:
        if not search:
            return False
        value = fn(props)
        if value is None or not is_text:
            return False
        return test(value, search) != negate
    return text_test


def _negate(operand: _Expr, pos: int) -> _Expr:
    # RocketMQ negates numbers and yields NULL for anything else (a property's text included).
    if operand.java in (_INT, _LONG, _DOUBLE):
        fn = operand.fn
        value = -operand.value if operand.literal else None
        return _Expr((lambda props: -fn(props)) if value is None else _constant(value), operand.java, pos,
                     value=value)
    return _Expr(_constant(None), _NULL, pos)


# --- tokens ----------------------------------------------------------------------------------------------------
_KEYWORDS = frozenset({"NOT", "AND", "OR", "BETWEEN", "IN", "TRUE", "FALSE", "NULL", "IS", "CONTAINS",
                       "STARTSWITH", "ENDSWITH"})
_TOKEN = re.compile(r"""
    (?P<space>[ \t\n\r\f]+)
  | (?P<comment>--[^\n\r]*|/\*.*?\*/)
  | (?P<float>(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)
  | (?P<int>0|[1-9][0-9]*[lL]?)
  | (?P<str>'(?:''|[^'])*')
  | (?P<id>[A-Za-z_$][A-Za-z0-9_$]*)
  | (?P<op><>|>=|<=|[=<>(),+-])
""", re.VERBOSE | re.DOTALL)


def _tokenize(text: str) -> list[tuple[str, Any, int]]:
    tokens: list[tuple[str, Any, int]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text.startswith("'", pos):
                raise SqlFilterError("the string literal is not closed", text, pos)
            if text.startswith("/*", pos):
                raise SqlFilterError("the comment is not closed", text, pos)
            raise SqlFilterError(f"unexpected character {text[pos]!r}", text, pos)
        kind = m.lastgroup
        raw = m.group()
        if kind == "float":
            value = float(raw)
            if math.isinf(value):
                raise SqlFilterError(f"{raw} is beyond the range of a double", text, pos)
            tokens.append(("NUM", (_DOUBLE, value), pos))
        elif kind == "int":
            value = int(raw.rstrip("lL"))
            if value > _LONG_RANGE[1]:
                raise SqlFilterError(f"{raw} is beyond the range of a long", text, pos)
            tokens.append(("NUM", (_INT if value <= _INT_RANGE[1] else _LONG, value), pos))
        elif kind == "str":
            tokens.append(("STR", raw[1:-1].replace("''", "'"), pos))
        elif kind == "id":
            upper = raw.upper()
            tokens.append(("KW", upper, pos) if upper in _KEYWORDS else ("ID", raw, pos))
        elif kind == "op":
            tokens.append(("OP", raw, pos))
        pos = m.end()
    tokens.append(("EOF", None, len(text)))
    return tokens


def _describe(token: tuple[str, Any, int]) -> str:
    kind, value, _ = token
    if kind == "EOF":
        return "the end"
    if kind == "STR":
        return f"string {value!r}"
    if kind == "NUM":
        return f"number {value[1]!r}"
    if kind == "ID":
        return f"property {value}"
    return repr(value)


def _show(expr: _Expr) -> str:
    if not expr.literal:
        return "a condition" if expr.condition else "the value"
    if expr.java == _NULL:
        return "NULL"
    if expr.java == _BOOL:
        return "TRUE" if expr.value else "FALSE"
    if expr.java == _STRING:
        return "'" + expr.value.replace("'", "''") + "'"
    return repr(expr.value)


# --- compiled filter -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class SqlFilter:
    """A compiled expression: ``matches(properties)`` is whether a message with these properties is selected."""

    expression: str
    _fn: Fn = dataclasses.field(repr=False)

    def evaluate(self, properties: Props) -> bool | None:
        """TRUE, FALSE or None (unknown); raises SqlEvaluationError where a property cannot be read."""
        return self._fn(properties)

    def matches(self, properties: Props) -> bool:
        try:
            return self._fn(properties) is True
        except (SqlEvaluationError, ArithmeticError, ValueError):
            # A value that cannot be read fails the message (RocketMQ's evaluation exception); any other error of the
            # kind a property's value could cause must too, rather than fail the pull (or the broker's hold service).
            return False


def compile_sql(expression: object) -> SqlFilter:
    """Parse ``expression``; raises SqlFilterError naming the problem and its position."""
    if not isinstance(expression, str):
        raise SqlFilterError(f"it must be a string, got {type(expression).__name__} {str(expression)[:40]!r}", "", None)
    if len(expression) > MAX_SQL_EXPRESSION_LENGTH:
        raise SqlFilterError(f"it is {len(expression)} characters long; at most {MAX_SQL_EXPRESSION_LENGTH} are "
                             f"allowed", expression, None)
    return _compile_cached(expression)


@lru_cache(maxsize=1024)
def _compile_cached(expression: str) -> SqlFilter:
    # Every pull of a consumer carries the same expression: it is parsed once. Errors are not cached (lru_cache
    # keeps only results), which costs a parse per refused request.
    if not expression.strip():
        raise SqlFilterError("it is empty", expression, None)
    return SqlFilter(expression, _Parser(expression).parse().fn)
