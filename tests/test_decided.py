"""How each served token was decided: the letters the stream carries for the web page."""

from pipeline.decoding.decided import ACCEPTED, BONUS, CORRECTED, PLAIN, ends_in_bonus, letters


def test_a_chain_ends_in_a_bonus_only_when_every_draft_was_kept():
    assert ends_in_bonus(None, 3, [0, 1, 2])
    assert not ends_in_bonus(None, 3, [0, 1])
    assert not ends_in_bonus(None, 3, [])
    assert not ends_in_bonus(None, 0, [])


def test_a_tree_ends_in_a_bonus_where_the_kept_path_reaches_a_leaf():
    parents = [-1, 0, -1, 2, 3]  # two branches: 0-1 and 2-3-4
    assert ends_in_bonus(parents, 5, [0, 1])  # the short branch, to its leaf
    assert not ends_in_bonus(parents, 5, [2, 3])  # node 4 continues node 3: the target corrected it


def test_letters_follow_the_step_and_a_stop_cuts_them():
    assert letters(0, 0, False, 1) == PLAIN
    assert letters(3, 3, True, 4) == ACCEPTED * 3 + BONUS
    assert letters(3, 1, False, 2) == ACCEPTED + CORRECTED
    assert letters(3, 1, False, 1) == ACCEPTED
