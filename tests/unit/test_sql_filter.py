"""RocketMQ's SQL92 selector (remoting.sql_filter): grammar, RocketMQ's evaluation rules, NULL, errors, bounds."""

from __future__ import annotations

import pytest

from remoting.sql_filter import (MAX_DEPTH, MAX_SQL_EXPRESSION_LENGTH, SqlEvaluationError, SqlFilterError,
                                 compile_sql)

UNKNOWN = None
ERROR = "error"


def outcome(expression: str, props: dict[str, str]) -> object:
    try:
        return compile_sql(expression).evaluate(props)
    except SqlEvaluationError:
        return ERROR


# (expression, properties, TRUE / FALSE / UNKNOWN / ERROR)
CASES = [
    # RocketMQ's documented example: a > 5 AND b = 'abc'
    ("a > 5 AND b = 'abc'", {"a": "10", "b": "abc", "c": "true"}, True),
    ("a > 5 AND b = 'abc'", {"a": "1", "b": "abc", "c": "true"}, False),
    # ExpressionType's example: (a > 10 AND a < 100) OR (b IS NOT NULL AND b=TRUE)
    ("(a > 10 AND a < 100) OR (b IS NOT NULL AND b=TRUE)", {"a": "50"}, True),
    ("(a > 10 AND a < 100) OR (b IS NOT NULL AND b=TRUE)", {"a": "500", "b": "true"}, True),
    ("(a > 10 AND a < 100) OR (b IS NOT NULL AND b=TRUE)", {"a": "500", "b": "false"}, False),
    ("(a > 10 AND a < 100) OR (b IS NOT NULL AND b=TRUE)", {"a": "500"}, False),
    # the documented consumer example
    ("a between 0 and 3", {"a": "0"}, True),
    ("a between 0 and 3", {"a": "3"}, True),
    ("a between 0 and 3", {"a": "4"}, False),
    # numeric comparisons
    ("a > 5", {"a": "6"}, True),
    ("a >= 5", {"a": "5"}, True),
    ("a < 5", {"a": "-6"}, True),
    ("a <= 5", {"a": "+5"}, True),
    ("a = 5", {"a": "5"}, True),
    ("a <> 5", {"a": "6"}, True),
    ("a = 5", {"a": "05"}, True),  # Integer.valueOf reads leading zeros
    ("5 < a", {"a": "6"}, True),
    ("a > -5", {"a": "-4"}, True),
    ("a > - -5", {"a": "6"}, True),
    ("a > +5", {"a": "6"}, True),
    # an int literal reads the property as a Java int: "5.5" and " 5" cannot be read, nor beyond 32 bits
    ("a > 5", {"a": "5.5"}, ERROR),
    ("a > 5", {"a": " 5"}, ERROR),
    ("a > 5", {"a": "abc"}, ERROR),
    ("a > 5", {"a": "3000000000"}, ERROR),
    ("a > 5L", {"a": "3000000000"}, ERROR),  # RocketMQ drops the L: 5L is an int all the same
    ("a > 3000000000", {"a": "3000000001"}, True),  # beyond 32 bits the literal is a long
    ("a > 5", {"a": "9223372036854775808"}, ERROR),
    # a decimal literal reads it as a double (Java's Double.valueOf: spaces trimmed, suffixes, NaN, Infinity)
    ("a > 5.0", {"a": "5.5"}, True),
    ("a > 5.0", {"a": " 5.5 "}, True),
    ("a > 5.0", {"a": "6"}, True),
    ("a > 5.0", {"a": "5.5d"}, True),
    ("a > 5.0", {"a": "1e3"}, True),
    ("a > 5.0", {"a": "Infinity"}, True),
    ("a > 5.0", {"a": "NaN"}, True),  # Double.compare puts NaN above everything
    ("a = .5", {"a": "0.5"}, True),
    ("a = 1E2", {"a": "100"}, True),
    ("a > 5.0", {"a": "five"}, ERROR),
    ("a = 5.0", {"a": "5"}, True),
    ("a > 0.0", {"a": "0.1"}, True),  # RocketMQ refuses 0.0 (below Double.MIN_VALUE); taken here
    # two properties compared by < > are both read as doubles; = compares their text
    ("a > b", {"a": "2", "b": "1.5"}, True),
    ("a > b", {"a": "x", "b": "1"}, ERROR),
    ("a = b", {"a": "x", "b": "x"}, True),
    ("a = b", {"a": "1.0", "b": "1"}, False),
    # strings
    ("color = 'red'", {"color": "red"}, True),
    ("color = 'red'", {"color": "Red"}, False),
    ("color <> 'red'", {"color": "blue"}, True),
    ("s = 'it''s'", {"s": "it's"}, True),
    ("s = ''", {"s": ""}, True),
    ("color IN ('red', 'blue')", {"color": "blue"}, True),
    ("color IN ('red', 'blue')", {"color": "green"}, False),
    ("color NOT IN ('red', 'blue')", {"color": "green"}, True),
    ("color NOT IN ('red', 'blue')", {"color": "red"}, False),
    ("n IN ('1', '2', '3', '4', '5', '6')", {"n": "6"}, True),
    ("t CONTAINS 'ell'", {"t": "hello"}, True),
    ("t NOT CONTAINS 'ell'", {"t": "hello"}, False),
    ("t STARTSWITH 'he'", {"t": "hello"}, True),
    ("t NOT STARTSWITH 'he'", {"t": "shell"}, True),
    ("t ENDSWITH 'lo'", {"t": "hello"}, True),
    ("t NOT ENDSWITH 'lo'", {"t": "hello"}, False),
    ("t CONTAINS ''", {"t": "hello"}, False),  # an empty search string matches nothing, negated or not
    ("t NOT CONTAINS ''", {"t": "hello"}, False),
    ("5 CONTAINS '5'", {}, False),  # only text contains anything
    # booleans: 'true' in any case is TRUE, any other text FALSE
    ("b = TRUE", {"b": "TRUE"}, True),
    ("b = TRUE", {"b": "True"}, True),
    ("b = FALSE", {"b": "no"}, True),
    ("b = TRUE", {"b": "1"}, False),
    ("TRUE", {}, True),
    ("FALSE", {}, False),
    ("NOT FALSE", {}, True),
    ("(a > 5) = TRUE", {"a": "6"}, True),
    ("5 = TRUE", {}, False),  # no conversion between a number and a boolean: never equal
    ("a", {"a": "true"}, False),  # a bare property is text, never TRUE
    ("a", {}, UNKNOWN),
    ("NOT a = 'x'", {"a": "x"}, ERROR),  # NOT binds tighter: (NOT a) = 'x', a boolean against text
    ("NOT (a = 'x')", {"a": "x"}, False),
    # TAGS is the tag
    ("TAGS = 'TagA' AND a > 1", {"TAGS": "TagA", "a": "2"}, True),
    ("TAGS IN ('TagA', 'TagB')", {"TAGS": "TagC"}, False),
    # NULL: comparisons with a missing property are unknown, and unknown never matches
    ("a > 5", {}, UNKNOWN),
    ("a = 'x'", {}, UNKNOWN),
    ("a <> 'x'", {}, UNKNOWN),
    ("a BETWEEN 1 AND 3", {}, UNKNOWN),
    ("a NOT BETWEEN 1 AND 3", {}, UNKNOWN),
    ("a IN ('x')", {}, UNKNOWN),
    ("a NOT IN ('x')", {}, UNKNOWN),
    ("NOT (a > 5)", {}, UNKNOWN),
    ("'x' = a", {}, False),  # RocketMQ's asymmetry: NULL on the right is FALSE
    ("NOT ('x' = a)", {}, True),
    ("a = b", {}, True),  # both NULL: equal, as RocketMQ's doCreateEqual
    ("a IS NULL", {}, True),
    ("a IS NULL", {"a": ""}, False),
    ("a IS NOT NULL", {}, False),
    ("a IS NOT NULL", {"a": "1"}, True),
    ("a CONTAINS 'x'", {}, False),
    ("a NOT CONTAINS 'x'", {}, False),
    ("a STARTSWITH 'x'", {}, False),
    ("a NOT ENDSWITH 'x'", {}, False),
    ("-a > 5", {"a": "1"}, UNKNOWN),  # only numbers are negated; anything else is NULL
    # three-valued AND / OR
    ("a > 5 AND FALSE", {}, False),
    ("a > 5 AND TRUE", {}, UNKNOWN),
    ("FALSE AND a > 5", {}, False),
    ("a > 5 OR TRUE", {}, True),
    ("a > 5 OR FALSE", {}, UNKNOWN),
    ("a > 5 OR b = 'x'", {"b": "x"}, True),
    ("NULL", {}, UNKNOWN),
    ("NULL OR TRUE", {}, True),
    # an evaluation error ends the evaluation, as RocketMQ's exception does
    ("a > 5 OR b = 'x'", {"a": "abc", "b": "x"}, ERROR),
    ("b = 'x' OR a > 5", {"a": "abc", "b": "x"}, True),  # short-circuit: a is never read
    ("FALSE AND a > 5", {"a": "abc"}, False),
    ("TRUE = a", {"a": "true"}, ERROR),  # RocketMQ casts the boolean to text and fails
    # BETWEEN / NOT BETWEEN
    ("a BETWEEN 3 AND 5 AND color IN ('red','blue')", {"a": "4", "color": "red"}, True),
    ("a BETWEEN 3 AND 5 AND color IN ('red','blue')", {"a": "6", "color": "red"}, False),
    ("a BETWEEN 3 AND 5 AND color IN ('red','blue')", {"a": "4", "color": "green"}, False),
    ("a BETWEEN 3 AND 5 AND color IN ('red','blue')", {"color": "red"}, UNKNOWN),
    ("a BETWEEN 3 AND 5 AND color IN ('red','blue')", {"a": "4"}, UNKNOWN),
    ("a NOT BETWEEN 3 AND 5", {"a": "2"}, True),
    ("a NOT BETWEEN 3 AND 5", {"a": "4"}, False),
    ("a BETWEEN 1.5 AND 2.5", {"a": "2"}, True),
    # syntax: keywords in any case, comments, whitespace, long chains stay flat
    ("a > 5 and B = 'x' or not c is null", {"a": "6", "B": "x"}, True),
    ("a > 5 -- a comment\n AND /* another */ b = 'x'", {"a": "6", "b": "x"}, True),
    ("$x = '1' AND _y_2 = '2'", {"$x": "1", "_y_2": "2"}, True),
    ("\ta\n>\r5\f", {"a": "6"}, True),
    (" AND ".join(f"p{i} = '{i}'" for i in range(200)), {f"p{i}": str(i) for i in range(200)}, True),
    (" OR ".join(f"p{i} = '{i}'" for i in range(200)), {"p199": "199"}, True),
]


@pytest.mark.parametrize(("expression", "props", "expected"), CASES, ids=[c[0][:60] for c in CASES])
def test_rocketmq_semantics(expression, props, expected):
    assert outcome(expression, props) == expected
    # A message matches only when the expression is TRUE; unknown and errors do not match.
    assert compile_sql(expression).matches(props) is (expected is True)


@pytest.mark.parametrize(("expression", "problem", "position"), [
    ("a > 'x'", "'x' cannot be compared with '>'", 4),
    ("a < TRUE", "TRUE cannot be compared with '<'", 4),
    ("a >= NULL", "NULL cannot be compared with '>='", 5),
    ("(a > 1) > 5", "a condition cannot be compared with '>'", 8),
    ("a = NULL", "NULL cannot be compared with '=' or '<>' (write IS NULL", 4),
    ("NULL <> a", "NULL cannot be compared", 0),
    ("TRUE = 'x'", "TRUE cannot be compared with 'x'", 5),
    ("5", "this is a value, not a condition", 0),
    ("'abc'", "this is a value, not a condition", 0),
    ("a > 5 AND 7", "this is a value, not a condition", 10),
    ("NOT 5", "this is a value, not a condition", 4),
    ("-a", "this is a value, not a condition", 0),
    ("a AND", "expected a property, a literal or '(', found the end", 5),
    ("(a > 5", "expected ')' closing the '(' at character 1, found the end", 6),
    ("a > 5)", "unexpected ')'", 5),
    ("a > 5 b", "unexpected property b", 6),
    ("a == 5", "expected a property, a literal or '(', found '='", 3),
    ("a != 5", "unexpected character '!'", 2),
    ("a = \"x\"", "unexpected character '\"'", 4),
    ("a = 'x", "the string literal is not closed", 4),
    ("a = 1 /* x", "the comment is not closed", 6),
    ("a IS 5", "expected NULL after IS, found number 5", 5),
    ("a IS NOT 'x'", "expected NULL after IS NOT", 9),
    ("a BETWEEN 5 AND 3", "the bounds of BETWEEN must be low AND high: 5 is above 3", 10),
    ("a BETWEEN NULL AND 3", "the bounds of BETWEEN cannot be NULL", 2),
    ("a BETWEEN 1 OR 3", "expected AND between the two bounds of BETWEEN, found 'OR'", 12),
    ("a BETWEEN 'a' AND 'b'", "'a' cannot be compared with '>='", 10),
    ("'x' IN ('a')", "IN needs a property on its left", 0),
    ("a IN ()", "expected a string in the IN list, found ')'", 6),
    ("a IN (1, 2)", "expected a string in the IN list, found number 1", 6),
    ("a IN 'x'", "expected '(' after IN, found string 'x'", 5),
    ("a IN ('x'", "expected ')' closing the IN list, found the end", 9),
    ("a CONTAINS 5", "expected a string after CONTAINS, found number 5", 11),
    ("a NOT LIKE 'x'", "unexpected 'NOT'", 2),
    ("a = 9223372036854775808", "9223372036854775808 is beyond the range of a long", 4),
    ("a > 1e400", "1e400 is beyond the range of a double", 4),
    ("a = 05", "unexpected number 5", 5),
])
def test_refusals_name_the_problem_and_its_position(expression, problem, position):
    with pytest.raises(SqlFilterError) as info:
        compile_sql(expression)
    assert info.value.position == position, str(info.value)
    assert problem in str(info.value)
    assert f"at character {position + 1}" in str(info.value)


def test_whole_expression_refusals():
    for expression, problem in [("", "it is empty"), ("  \n", "it is empty"), (None, "it must be a string"),
                                (5, "it must be a string, got int '5'"),
                                ("a = 'x' OR " * 500 + "TRUE", f"at most {MAX_SQL_EXPRESSION_LENGTH} are allowed")]:
        with pytest.raises(SqlFilterError, match="^SQL92 expression: ") as info:
            compile_sql(expression)
        assert problem in str(info.value)
        assert info.value.position is None


def test_the_longest_expression_is_taken():
    expression = "a = '" + "x" * (MAX_SQL_EXPRESSION_LENGTH - 6) + "'"
    assert len(expression) == MAX_SQL_EXPRESSION_LENGTH
    assert compile_sql(expression).matches({"a": "x" * (MAX_SQL_EXPRESSION_LENGTH - 6)})


@pytest.mark.parametrize("build", [
    lambda n: "(" * n + "a > 1" + ")" * n,
    lambda n: "NOT " * n + "TRUE",
    lambda n: "- " * n + "1 < a",
    lambda n: "TRUE" + " = TRUE" * n,
    lambda n: "(" * n + "TRUE" + " AND TRUE)" * n,
])
def test_nesting_is_bounded(build):
    """Deep input is refused with a position, neither parsed nor evaluated into a RecursionError; what is within the
    bound works."""
    assert compile_sql(build(MAX_DEPTH - 2)).evaluate({"a": "2"}) is not ERROR
    with pytest.raises(SqlFilterError, match=f"nests deeper than {MAX_DEPTH} levels at character"):
        compile_sql(build(MAX_DEPTH + 1))
    with pytest.raises(SqlFilterError, match="nests deeper"):
        compile_sql(build(300))


def test_an_expression_is_compiled_once():
    assert compile_sql("x = 'cached' AND y > 2") is compile_sql("x = 'cached' AND y > 2")


def test_evaluation_reads_properties_of_any_mapping():
    sql = compile_sql("a > 1 AND b IS NULL")
    assert sql.matches({"a": "2"})
    assert not sql.matches({"a": "2", "b": ""})
    assert sql.expression == "a > 1 AND b IS NULL"


def test_a_property_of_thousands_of_digits_fails_its_message_not_the_evaluation():
    """int() of a text of more than 4,300 digits raises ValueError (CPython's conversion limit): a property of
    5,000 nines raised out of ``matches``, failing every pull of its queue and the broker's hold service. Now it is
    no Java int or long (as in RocketMQ: more than 19 digits is a NumberFormatException), so the message does not
    match; leading zeros are ignored, as Java's parser does."""
    assert compile_sql("a > 5").matches({"a": "9" * 5000}) is False
    assert compile_sql("a > 5").matches({"a": "-" + "9" * 5000}) is False
    assert compile_sql("a = 7").matches({"a": "0" * 5000 + "7"}) is True
    assert compile_sql("a > 5").matches({"a": "+" + "0" * 30 + "6"}) is True
    assert compile_sql("a > 5.0").matches({"a": "9" * 5000}) is True  # a double: infinity, as Java's
    assert compile_sql("a = 9223372036854775807").matches({"a": "9223372036854775807"}) is True
    assert compile_sql("a < 0").matches({"a": "-2147483648"}) is True  # an int literal reads a Java int
    assert compile_sql("a < 0").matches({"a": "-2147483649"}) is False
    assert compile_sql("a = 9223372036854775807").matches({"a": "92233720368547758070"}) is False  # past a long
