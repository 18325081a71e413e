"""An ONNX model with operators cuvil does not compile: all are reported at once, with their nodes.

needs: onnx
raises: UnsupportedOpError
says: the model uses 2 operator type(s) cuvil does not support at opset 17
says: Det (node 'det')
says: Unique (node 'unique')
"""

from onnx import TensorProto, helper

import cuvil.onnx

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det"),
                           helper.make_node("Unique", ["x"], ["z"], name="unique")], "g", [x], [y, z])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
cuvil.onnx.InferenceSession(model.SerializeToString())
