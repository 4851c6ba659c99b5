import json, numpy as np
from media.turn_model import TurnModel
from benchmarks.corpus import load_corpus
from benchmarks.hesitation import load_hesitation
from benchmarks.turn_context import _voiced_end
SIL=(200,250,300,350,400,500)
m=TurnModel.load()
def sc(a):
    return [round(m._score(np.concatenate([a,np.zeros(ms*16,np.int16)]).tobytes()),3) for ms in SIL]
print("silence ms", SIL)
print("== done: benchmark corpus")
for u in load_corpus().values():
    if u.kind in ("question","long_question"):
        a=np.frombuffer(u.pcm(),np.int16); print(f"{u.id:22s}", sc(a[:_voiced_end(a)]))
print("== done: hesitation line ends")
for l in load_hesitation():
    a=np.frombuffer(l.pcm(),np.int16); print(f"{l.id:22s}", sc(a[:_voiced_end(a)]))
print("== not done: at the inserted pause")
for l in load_hesitation():
    if l.pause_at_ms is None: continue
    a=np.frombuffer(l.pcm(),np.int16)[:int(l.pause_at_ms*16)]
    print(f"{l.id:22s}", sc(a))
