"""``cuvil compile`` with a target name that does not exist: one line on stderr, exit status 1.

needs: onnx
exits: 1
says: cuvil: error: unknown target kind 'fpga' in 'fpga'; known kinds: llvm, cuda
"""

import os
import sys
import tempfile

import onnx
from onnx import TensorProto, helper

from cuvil.cli import main

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "relu.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    sys.exit(main(["compile", path, "--target", "fpga"]))
