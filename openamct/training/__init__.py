"""What runs during training beside the compressed model: the record keeper (its forward hooks
and background writer thread, ``keeper.py``) and the rollback of a forward that raised
(``rollback.py``). The record's file formats it writes are ``openamct.record``'s."""
