"""The engine core: the scheduler and the cache over one model runner, stepped by one loop
(``core_loop``) on a thread of this process or in a process of its own (``core_proc``);
grammars compile beside it. It takes validated, tokenized requests and emits token ids."""
