"""The terminal filter of ``logs``: colour passes, every other control sequence is shown, whatever the chunking."""

from __future__ import annotations

from tui.hosttext import TerminalFilter, printable, printable_lines

LOG = "\x1b[31mred\x1b[0m \x1b]0;TITLE\x07\x1b]52;c;SGk=\x07\x1b[2J done\r\n"


def test_a_terminal_gets_colour_and_every_other_sequence_as_signs_for_any_chunking() -> None:
    data = LOG.encode()
    whole = TerminalFilter()
    expected = whole.feed(data) + whole.flush()
    assert expected == "\x1b[31mred\x1b[0m ␛]0;TITLE␇␛]52;c;SGk=␇␛[2J done\r\n".encode()
    for size in range(1, len(data)):
        cut = TerminalFilter()
        got = b"".join(cut.feed(data[i : i + size]) for i in range(0, len(data), size)) + cut.flush()
        assert got == expected, size


def test_a_c0_control_is_one_sign_and_a_c1_surrogate_or_direction_character_its_escape() -> None:
    hostile = "\x1b]0;X\x07\x1b[2Ja\nb\x9b\ud800\u202e\t"
    assert printable(hostile) == "␛]0;X␇␛[2Ja⏎b\\x9b\\ud800\\u202e\t"
    assert printable_lines("a\r\nb\x1b") == "a\nb␛"
