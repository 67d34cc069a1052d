# Source this first on the offline GPU machine:  source .gpu/enter.sh && make test-gpu
# (tools/gpu-prepare.sh copies it to .gpu/.) It installs the carried wheels into /tmp/site,
# puts them and the checkout on PYTHONPATH, and prints one line about the machine, so every
# log says where it ran.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -c "import torch,sys; print('gpu-machine:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA', '| torch', torch.__version__, '| python', sys.version.split()[0])"
