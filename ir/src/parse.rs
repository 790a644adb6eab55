//! Parser for the text form written by `print::print_graph`.
//!
//! Every op's result types are re-derived by shape inference and must equal the printed
//! ones, so a parsed graph is typed exactly like a built one.

use crate::graph::{Graph, Op, OpId, Value, ValueDef, ValueId};
use crate::infer::infer_types;
use crate::mesh::Mesh;
use crate::op::OpKind;
use crate::types::{Axis, DType, Dim, Layout, TensorType};
use crate::IrError;

/// Parse a graph from its text form.
pub fn parse_graph(text: &str) -> Result<Graph, IrError> {
    let mut graph: Option<Graph> = None;
    let mut slots: Vec<Option<Value>> = Vec::new();
    let mut closed = false;
    for (lineno, raw) in text.lines().enumerate() {
        let mut c = Cursor {
            s: raw,
            pos: 0,
            line: lineno + 1,
        };
        c.skip_ws();
        if c.at_end() {
            continue;
        }
        if closed {
            return Err(c.err("text after the closing `}`"));
        }
        let Some(g) = graph.as_mut() else {
            c.keyword("graph")?;
            let name = c.string()?;
            c.expect("{")?;
            c.end()?;
            graph = Some(Graph::new(name, Mesh::single()));
            continue;
        };
        if c.eat("}") {
            c.end()?;
            closed = true;
        } else if c.eat_keyword("mesh") {
            let mut axes = Vec::new();
            while !c.at_end() {
                let start = c.here();
                let name = c.ident()?;
                let axis = Axis::from_name(&name)
                    .ok_or_else(|| c.err_at(start, &format!("unknown mesh axis `{name}`")))?;
                c.expect("=")?;
                axes.push((axis, c.uint()?));
            }
            g.mesh = Mesh { axes };
        } else if c.eat_keyword("input") || c.eat_keyword("param") {
            let is_input = raw.trim_start().starts_with("input");
            let id = c.value_id()?;
            let name = c.string()?;
            c.expect(":")?;
            let ty = c.tensor_type()?;
            c.end()?;
            let def = if is_input {
                ValueDef::Input(name)
            } else {
                ValueDef::Param(name)
            };
            define(&mut slots, id, Value { ty, def }, &c)?;
        } else if c.eat_keyword("output") {
            let name = c.string()?;
            c.expect("=")?;
            let start = c.here();
            let id = c.value_id()?;
            if slot(&slots, id).is_none() {
                return Err(c.err_at(start, &format!("%{} is not defined", id.0)));
            }
            c.end()?;
            g.outputs.push((name, id));
        } else {
            parse_op_line(g, &mut slots, &mut c)?;
        }
    }
    let Some(mut g) = graph else {
        return Err(IrError::Parse {
            line: 1,
            col: 1,
            message: "expected `graph \"NAME\" {`".into(),
        });
    };
    if !closed {
        return Err(IrError::Parse {
            line: text.lines().count().max(1),
            col: 1,
            message: "missing closing `}`".into(),
        });
    }
    for (i, v) in slots.into_iter().enumerate() {
        match v {
            Some(v) => g.values.push(v),
            None => {
                return Err(IrError::Parse {
                    line: 1,
                    col: 1,
                    message: format!("value %{i} is never defined (ids must be dense)"),
                })
            }
        }
    }
    Ok(g)
}

fn parse_op_line(
    g: &mut Graph,
    slots: &mut Vec<Option<Value>>,
    c: &mut Cursor,
) -> Result<(), IrError> {
    let mut results: Vec<(ValueId, TensorType, usize)> = Vec::new();
    loop {
        let start = c.here();
        let id = c.value_id()?;
        c.expect(":")?;
        let ty = c.tensor_type()?;
        results.push((id, ty, start));
        if !c.eat(",") {
            break;
        }
    }
    c.expect("=")?;
    let name_start = c.here();
    let name = c.ident()?;
    c.expect("(")?;
    let mut inputs = Vec::new();
    if !c.eat(")") {
        loop {
            let start = c.here();
            let id = c.value_id()?;
            if slot(slots, id).is_none() {
                return Err(c.err_at(start, &format!("%{} is used before it is defined", id.0)));
            }
            inputs.push(id);
            if c.eat(")") {
                break;
            }
            c.expect(",")?;
        }
    }
    let mut attrs: Vec<(String, String, usize)> = Vec::new();
    if c.eat("{") {
        loop {
            let start = c.here();
            let key = c.ident()?;
            c.expect("=")?;
            let val = c.word()?;
            attrs.push((key, val, start));
            if c.eat("}") {
                break;
            }
            c.expect(",")?;
        }
    }
    c.expect("#")?;
    c.skip_ws();
    let path = c.s[c.pos..].trim_end().to_string();
    if path.is_empty() {
        return Err(c.err("missing provenance path after `#`"));
    }
    let kind = op_kind(&name, &attrs, c, name_start)?;
    let in_types: Vec<&TensorType> = inputs
        .iter()
        .map(|&v| &slot(slots, v).expect("checked defined").ty)
        .collect();
    let inferred =
        infer_types(&kind, &in_types).map_err(|m| c.err_at(name_start, &format!("{name}: {m}")))?;
    if inferred.len() != results.len() {
        return Err(c.err_at(
            name_start,
            &format!(
                "{name} has {} results, {} written",
                inferred.len(),
                results.len()
            ),
        ));
    }
    let op_id = OpId(g.ops.len() as u32);
    let mut outputs = Vec::new();
    for (i, ((id, ty, start), want)) in results.into_iter().zip(inferred).enumerate() {
        if ty.dtype != want.dtype || ty.dims != want.dims {
            return Err(c.err_at(
                start,
                &format!(
                    "written type {} disagrees with the inferred {}",
                    ty.dtype_shape(),
                    want.dtype_shape()
                ),
            ));
        }
        define(
            slots,
            id,
            Value {
                ty,
                def: ValueDef::Op(op_id, i),
            },
            c,
        )?;
        outputs.push(id);
    }
    g.ops.push(Op {
        kind,
        inputs,
        outputs,
        path,
    });
    Ok(())
}

fn op_kind(
    name: &str,
    attrs: &[(String, String, usize)],
    c: &Cursor,
    at: usize,
) -> Result<OpKind, IrError> {
    let lookup = |key: &str| {
        attrs
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, v, _)| v.clone())
    };
    let kind = OpKind::from_text(name, &lookup).map_err(|m| c.err_at(at, &m))?;
    let known: Vec<&str> = kind.attrs().iter().map(|(k, _)| *k).collect();
    for (k, _, start) in attrs {
        if !known.contains(&k.as_str()) {
            return Err(c.err_at(*start, &format!("{name} has no attribute `{k}`")));
        }
    }
    Ok(kind)
}

fn slot(slots: &[Option<Value>], id: ValueId) -> Option<&Value> {
    slots.get(id.0 as usize).and_then(Option::as_ref)
}

fn define(
    slots: &mut Vec<Option<Value>>,
    id: ValueId,
    v: Value,
    c: &Cursor,
) -> Result<(), IrError> {
    let i = id.0 as usize;
    if i >= slots.len() {
        slots.resize(i + 1, None);
    }
    if slots[i].is_some() {
        return Err(c.err(&format!("%{i} is defined twice")));
    }
    slots[i] = Some(v);
    Ok(())
}

/// A position in one line of the text form.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
    line: usize,
}

impl Cursor<'_> {
    fn err(&self, message: &str) -> IrError {
        self.err_at(self.pos, message)
    }

    fn err_at(&self, pos: usize, message: &str) -> IrError {
        IrError::Parse {
            line: self.line,
            col: self.s[..pos.min(self.s.len())].chars().count() + 1,
            message: message.to_string(),
        }
    }

    /// Skip whitespace and return the position of the next token.
    fn here(&mut self) -> usize {
        self.skip_ws();
        self.pos
    }

    fn rest(&self) -> &str {
        &self.s[self.pos..]
    }

    fn skip_ws(&mut self) {
        let trimmed = self.rest().trim_start();
        self.pos = self.s.len() - trimmed.len();
    }

    fn at_end(&self) -> bool {
        self.rest().trim().is_empty()
    }

    fn end(&mut self) -> Result<(), IrError> {
        self.skip_ws();
        if self.at_end() {
            Ok(())
        } else {
            Err(self.err("unexpected text at end of line"))
        }
    }

    fn eat(&mut self, tok: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(tok) {
            self.pos += tok.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, tok: &str) -> Result<(), IrError> {
        if self.eat(tok) {
            Ok(())
        } else {
            Err(self.err(&format!("expected `{tok}`")))
        }
    }

    fn eat_keyword(&mut self, kw: &str) -> bool {
        self.skip_ws();
        let rest = self.rest();
        if rest.starts_with(kw)
            && rest[kw.len()..]
                .chars()
                .next()
                .is_none_or(|c| c.is_whitespace())
        {
            self.pos += kw.len();
            true
        } else {
            false
        }
    }

    fn keyword(&mut self, kw: &str) -> Result<(), IrError> {
        if self.eat_keyword(kw) {
            Ok(())
        } else {
            Err(self.err(&format!("expected `{kw}`")))
        }
    }

    fn take_while(&mut self, f: impl Fn(char) -> bool) -> &str {
        self.skip_ws();
        let start = self.here();
        let len: usize = self
            .rest()
            .chars()
            .take_while(|&c| f(c))
            .map(char::len_utf8)
            .sum();
        self.pos += len;
        &self.s[start..self.pos]
    }

    fn ident(&mut self) -> Result<String, IrError> {
        let w = self.take_while(|c| c.is_ascii_alphanumeric() || c == '_' || c == '*');
        if w.is_empty() {
            Err(self.err("expected a name"))
        } else {
            Ok(w.to_string())
        }
    }

    /// An attribute value: a number or a name.
    fn word(&mut self) -> Result<String, IrError> {
        let w = self.take_while(|c| c.is_ascii_alphanumeric() || "_.-+".contains(c));
        if w.is_empty() {
            Err(self.err("expected a value"))
        } else {
            Ok(w.to_string())
        }
    }

    fn uint(&mut self) -> Result<u64, IrError> {
        let start = self.here();
        let w = self.take_while(|c| c.is_ascii_digit());
        w.parse()
            .map_err(|_| self.err_at(start, "expected an unsigned integer"))
    }

    fn value_id(&mut self) -> Result<ValueId, IrError> {
        self.expect("%")?;
        let n = self.uint()?;
        u32::try_from(n)
            .map(ValueId)
            .map_err(|_| self.err("value id too large"))
    }

    fn string(&mut self) -> Result<String, IrError> {
        self.expect("\"")?;
        let Some(len) = self.rest().find('"') else {
            return Err(self.err("unterminated string"));
        };
        let s = self.rest()[..len].to_string();
        self.pos += len + 1;
        Ok(s)
    }

    fn tensor_type(&mut self) -> Result<TensorType, IrError> {
        let start = self.here();
        let name = self.ident()?;
        let dtype = DType::from_name(&name)
            .ok_or_else(|| self.err_at(start, &format!("unknown dtype `{name}`")))?;
        self.expect("[")?;
        let mut dims = Vec::new();
        if !self.eat("]") {
            loop {
                let name = self.ident()?;
                let dynamic = if self.eat("<=") {
                    true
                } else {
                    self.expect("=")?;
                    false
                };
                let size = self.uint()?;
                dims.push(Dim {
                    name,
                    size,
                    dynamic,
                });
                if self.eat("]") {
                    break;
                }
                self.expect(",")?;
            }
        }
        let layout = self.layout(&dims)?;
        Ok(TensorType {
            dtype,
            dims,
            layout,
        })
    }

    fn layout(&mut self, dims: &[Dim]) -> Result<Layout, IrError> {
        self.expect("{")?;
        let mut layout = Layout::replicated(dims.len());
        if self.eat("R}") {
            return Ok(layout);
        }
        loop {
            let start = self.here();
            let key = self.ident()?;
            self.expect(":")?;
            let mut axes = Vec::new();
            loop {
                let at = self.here();
                let a = self.ident()?;
                axes.push(
                    Axis::from_name(&a)
                        .ok_or_else(|| self.err_at(at, &format!("unknown mesh axis `{a}`")))?,
                );
                if !self.eat("+") {
                    break;
                }
            }
            if key == "partial" {
                layout.partial = axes;
            } else {
                let i = dims.iter().position(|d| d.name == key).ok_or_else(|| {
                    self.err_at(start, &format!("layout names `{key}`, which is not a dim"))
                })?;
                layout.shards[i] = axes;
            }
            if self.eat("}") {
                break;
            }
            self.expect(",")?;
        }
        Ok(layout)
    }
}
