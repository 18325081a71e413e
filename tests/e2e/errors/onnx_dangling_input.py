"""A node reads a value that no input, initializer or earlier node defines.

needs: onnx
raises: ModelError
says: Add node 'add': input 'bias' is not a graph input, an initializer or an earlier node's output
"""

from onnx import TensorProto, helper

import cuvil.onnx

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
graph = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["y"], name="add")], "g", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
cuvil.onnx.InferenceSession(model.SerializeToString())
