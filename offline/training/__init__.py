"""Training, apart from the serving-time drafters: the stdlib corpus (``corpus``), target
pretraining with its tokenizer (``pretrain``), drafter distillation and acceptance measurement
(``distill``)."""
