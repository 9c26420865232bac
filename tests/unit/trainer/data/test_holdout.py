from engine.trainer.data.holdout import heldout_indices


def test_heldout_split_is_seeded_sized_and_leaves_training_data() -> None:
    a = heldout_indices(100, 10, seed=3)
    assert a == heldout_indices(100, 10, seed=3)
    assert len(a) == 10 and all(0 <= i < 100 for i in a)
    assert a != heldout_indices(100, 10, seed=4)
    assert len(heldout_indices(5, 10, seed=0)) == 4  # one conversation always stays for training
    assert heldout_indices(100, 0, seed=0) == frozenset()
