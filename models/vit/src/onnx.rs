//! Just enough of the ONNX protobuf format to read a graph's float initializers and its
//! nodes' names and inputs (which name the anonymous `onnx::MatMul_*` weights).

use std::collections::HashMap;

use burnscale_nn::weights::Weight;

pub(crate) struct Node {
    pub name: String,
    pub inputs: Vec<String>,
}

pub(crate) struct Graph {
    pub initializers: HashMap<String, Weight>,
    pub nodes: Vec<Node>,
}

impl Graph {
    /// The initializer feeding input `index` of the node called `node`.
    pub fn input_of(&self, node: &str, index: usize) -> Result<&Weight, String> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.name == node)
            .ok_or_else(|| format!("no node `{node}`"))?;
        let input = node
            .inputs
            .get(index)
            .ok_or_else(|| format!("node `{}` has no input {index}", node.name))?;
        self.initializers
            .get(input)
            .ok_or_else(|| format!("input `{input}` of node `{}` is not a weight", node.name))
    }
}

/// Parses a `ModelProto`.
pub(crate) fn parse(bytes: &[u8]) -> Result<Graph, String> {
    const MODEL_GRAPH: u64 = 7;
    const GRAPH_NODE: u64 = 1;
    const GRAPH_INITIALIZER: u64 = 5;
    let mut graph = Graph {
        initializers: HashMap::new(),
        nodes: Vec::new(),
    };
    let mut found_graph = false;
    for field in Fields(bytes) {
        let (number, value) = field?;
        if number != MODEL_GRAPH {
            continue;
        }
        found_graph = true;
        for field in Fields(value.bytes()?) {
            match field? {
                (GRAPH_NODE, value) => graph.nodes.push(node(value.bytes()?)?),
                (GRAPH_INITIALIZER, value) => {
                    if let Some(w) = tensor(value.bytes()?)? {
                        graph.initializers.insert(w.key.clone(), w);
                    }
                }
                _ => {}
            }
        }
    }
    if found_graph {
        Ok(graph)
    } else {
        Err("no graph in the model".into())
    }
}

fn node(bytes: &[u8]) -> Result<Node, String> {
    let mut node = Node {
        name: String::new(),
        inputs: Vec::new(),
    };
    for field in Fields(bytes) {
        match field? {
            (1, value) => node.inputs.push(value.string()?),
            (3, value) => node.name = value.string()?,
            _ => {}
        }
    }
    Ok(node)
}

/// A float `TensorProto` as a [`Weight`]; `None` for integer and boolean ones (graph
/// constants), an error for floats other than float32.
fn tensor(bytes: &[u8]) -> Result<Option<Weight>, String> {
    const FLOAT: u64 = 1;
    let (mut shape, mut dtype, mut name) = (Vec::new(), 0, String::new());
    let (mut raw, mut floats) = (None, Vec::new());
    for field in Fields(bytes) {
        match field? {
            (1, Value::Varint(d)) => shape.push(d as usize),
            (1, Value::Bytes(packed)) => {
                let mut rest = packed;
                while !rest.is_empty() {
                    shape.push(varint(&mut rest)? as usize);
                }
            }
            (2, value) => dtype = value.varint()?,
            (4, Value::Bytes(packed)) => floats.extend(
                packed
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            (4, Value::Fixed32(v)) => floats.push(f32::from_bits(v)),
            (8, value) => name = value.string()?,
            (9, value) => raw = Some(value.bytes()?),
            (14, Value::Varint(1)) => {
                return Err(format!(
                    "tensor `{name}` keeps its data in an external file"
                ));
            }
            _ => {}
        }
    }
    // Weights of another float type would leave the backbone's weights missing, named as if
    // the file were another model's.
    const OTHER_FLOATS: [(u64, &str); 3] = [(10, "float16"), (11, "float64"), (16, "bfloat16")];
    if let Some((_, kind)) = OTHER_FLOATS.iter().find(|(t, _)| *t == dtype) {
        return Err(format!(
            "tensor `{name}` is {kind}: export the model in float32"
        ));
    }
    if dtype != FLOAT {
        return Ok(None);
    }
    let values: Vec<f32> = match raw {
        Some(raw) => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        None => floats,
    };
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if numel != Some(values.len()) {
        return Err(format!(
            "tensor `{name}` has {} values for shape {shape:?}",
            values.len()
        ));
    }
    Ok(Some(Weight::new(name, shape, values)))
}

enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32(u32),
}

impl<'a> Value<'a> {
    fn bytes(self) -> Result<&'a [u8], String> {
        match self {
            Value::Bytes(b) => Ok(b),
            _ => Err("expected a length-delimited field".into()),
        }
    }

    fn string(self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|e| e.to_string())
    }

    fn varint(self) -> Result<u64, String> {
        match self {
            Value::Varint(v) => Ok(v),
            _ => Err("expected a varint field".into()),
        }
    }
}

/// The (field number, value) pairs of one protobuf message.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        Some(self.field())
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u64, Value<'a>), String> {
        let key = varint(&mut self.0)?;
        let value = match key & 7 {
            0 => Value::Varint(varint(&mut self.0)?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let len = varint(&mut self.0)? as usize;
                Value::Bytes(self.take(len)?)
            }
            5 => {
                let b = self.take(4)?;
                Value::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            other => return Err(format!("unsupported protobuf wire type {other}")),
        };
        Ok((key >> 3, value))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.0.len() {
            return Err("the file ends inside a field (truncated?)".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
}

fn varint(bytes: &mut &[u8]) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = bytes
            .split_first()
            .ok_or("the file ends inside a number (truncated?)")?;
        *bytes = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("a protobuf varint longer than 10 bytes".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(number: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![(number << 3 | 2) as u8, payload.len() as u8];
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn reads_a_hand_built_model() {
        let values: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let tensor = [
            vec![1 << 3, 2], // dims: 2
            vec![2 << 3, 1], // data_type: FLOAT
            field(8, b"w"),
            field(9, &values),
        ]
        .concat();
        let node = [field(1, b"x"), field(1, b"w"), field(3, b"mm")].concat();
        let graph = [field(1, &node), field(5, &tensor)].concat();
        let model = [vec![1 << 3, 7], field(7, &graph)].concat();
        let graph = parse(&model).unwrap();
        let w = graph.input_of("mm", 1).unwrap();
        assert_eq!(
            (w.shape.clone(), w.values.clone()),
            (vec![2], vec![1.5, -2.0])
        );
        assert!(graph.input_of("mm", 0).is_err());
        let truncated = parse(&model[..model.len() - 3]).err().unwrap();
        assert!(truncated.contains("truncated"), "{truncated}");
    }

    /// A float16 weight is named for its type, and dims whose product overflows are an
    /// error, not a panic (or, wrapped to 0, a tensor of no values).
    #[test]
    fn weights_it_cannot_read_are_named() {
        let varint = |mut v: u64| {
            let mut out = Vec::new();
            while v >= 0x80 {
                out.push((v as u8) | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
            out
        };
        let dim = |d: u64| [vec![1 << 3], varint(d)].concat();
        let half = [dim(2), vec![2 << 3, 10], field(8, b"w"), field(9, &[0; 4])].concat();
        assert!(tensor(&half).unwrap_err().contains("`w` is float16"));
        let huge = [dim(1 << 32), dim(1 << 32), vec![2 << 3, 1], field(8, b"w")].concat();
        let err = tensor(&huge).unwrap_err();
        assert!(err.contains("has 0 values for shape"), "{err}");
    }
}
