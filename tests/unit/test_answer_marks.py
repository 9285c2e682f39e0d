"""`AnswerMarks`: a worker's latest answers by size, which its silent peers are compared with."""

from __future__ import annotations

from gateway.backends.answer_marks import AnswerMarks


def test_an_answer_counts_for_requests_sent_no_later_and_no_larger() -> None:
    marks = AnswerMarks()
    marks.mark(sent_at=10.0, budget=120.0, stream=False)
    assert marks.answered_since(10.0, 120.0, stream=False)
    assert marks.answered_since(9.0, 100.0, stream=False)
    assert not marks.answered_since(10.5, 120.0, stream=False)  # sent before the silent request
    assert not marks.answered_since(9.0, 121.0, stream=False)  # a shorter request than the silent one
    assert not marks.answered_since(9.0, 500.0, stream=False)
    marks.mark(sent_at=11.0, budget=600.0, stream=False)  # a larger class answers for every smaller one
    assert marks.answered_since(10.5, 121.0, stream=False)


def test_a_streams_headers_say_nothing_of_a_whole_answer() -> None:
    marks = AnswerMarks()
    marks.mark(sent_at=10.0, budget=300.0, stream=True)
    assert marks.answered_since(10.0, 60.0, stream=True)
    assert not marks.answered_since(10.0, 60.0, stream=False)
    marks.mark(sent_at=10.0, budget=130.0, stream=False)  # a whole answer answers for a stream too
    assert marks.answered_since(10.0, 130.0, stream=True)


def test_the_latest_of_a_class_is_kept() -> None:
    marks = AnswerMarks()
    marks.mark(sent_at=12.0, budget=100.0, stream=False)
    marks.mark(sent_at=11.0, budget=127.0, stream=False)  # older: the newer one of the class stays
    assert marks.answered_since(12.0, 100.0, stream=False)
    assert not marks.answered_since(11.0, 127.0, stream=False)  # forgotten: a miss, never a false match
