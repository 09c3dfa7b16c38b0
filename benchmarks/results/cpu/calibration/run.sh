set -x
# From the repo root, with fp8route installed (pip install -e .).
R=benchmarks/results/cpu/calibration
BF16=/root/.cache/fp8route/models/smollm2-135m-instruct-bf16
Q="python3 -m fp8route quantize $BF16"
$Q /tmp/calibrun/p9999 --format modelopt --calib-text $R/calib.txt --input-scale percentile --percentile 99.99 --device cpu --quiet
$Q /tmp/calibrun/mse --format modelopt --calib-text $R/calib.txt --input-scale mse --device cpu --quiet
$Q /tmp/calibrun/p999 --format modelopt --calib-text $R/calib.txt --input-scale percentile --percentile 99.9 --device cpu --quiet
for m in max p9999 mse p999; do
  mkdir -p $R/$m
  /usr/bin/time -f "%e s" python3 -m fp8route eval $BF16 --compare /tmp/calibrun/$m --task hellaswag --limit 200 --device cpu --batch-size 16 --out $R/$m --quiet
done
