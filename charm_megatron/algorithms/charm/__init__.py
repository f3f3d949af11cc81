"""RM+ (``rmplus``) and CHARM+ (``charm``): functions over one explicit per-rank state
(:mod:`.state`): the RM+ units and passes (:mod:`.rmplus`), the cross-group query exchange
(:mod:`.cross`), pass-q (:mod:`.pass_q`), pass-kv (:mod:`.pass_kv`), one rank's program
(:mod:`.program`) and the two registry entries with their settings (:mod:`.entry`)."""
