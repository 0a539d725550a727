import Foundation

/// Everything the host contributes to a step (CONTRACT §2-3): int8 embedding rows and their scales, read by row,
/// and the RoPE rows; the Swift mirror of `gemma_ane/bundle/tables.py` with its arithmetic kept exactly.
public struct HostTables: Sendable {
    public let embed: RowTable
    public let embedScales: [Float]
    public let ple: RowTable
    public let pleScales: [Float]
    public let embedScale: Double
    public let perLayerEmbedScale: Double
    /// layer type ("sliding_attention", "full_attention") -> (cos, sin) tables
    public let rope: [String: (cos: NpyTable, sin: NpyTable)]

    /// The bundle's host tables as `tables.load_host` reads them (each file's size checked against the config).
    public init(root: URL, config: ModelConfig) throws {
        let V = config.vocabSize, H = config.hiddenSize
        let (PL, overflow) = config.numHiddenLayers.multipliedReportingOverflow(by: config.perLayerDim)
        guard !overflow else {
            throw GemmaANEError(.bundle, "\(root.appendingPathComponent(BundleLayout.modelConfig).path): per_layer_dim: too large")
        }
        embed = try RowTable(root.appendingPathComponent(BundleLayout.embedQ8), rows: V, columns: H)
        embedScales = try readHalfs(root.appendingPathComponent(BundleLayout.embedScales), count: V)
        ple = try RowTable(root.appendingPathComponent(BundleLayout.pleQ8), rows: V, columns: PL)
        pleScales = try readHalfs(root.appendingPathComponent(BundleLayout.pleScales), count: V)
        embedScale = config.embedScale
        perLayerEmbedScale = config.perLayerEmbedScale
        var rope: [String: (cos: NpyTable, sin: NpyTable)] = [:]
        for (layerType, short) in BundleLayout.ropeShort {
            let cos = root.appendingPathComponent("cos_\(short).npy"), sin = root.appendingPathComponent("sin_\(short).npy")
            if FileManager.default.fileExists(atPath: cos.path) || (config.layerTypes ?? []).contains(layerType) {
                let pair = (cos: try NpyTable(cos), sin: try NpyTable(sin))
                guard pair.cos.rows == pair.sin.rows, pair.cos.columns == pair.sin.columns else {
                    throw GemmaANEError(.bundle, "\(sin.path): shape differs from \(cos.lastPathComponent)'s")
                }
                rope[layerType] = pair
            }
        }
        self.rope = rope
    }

    /// (hidden_states [T*H], per_layer_raw [T*PL]) in Float: `value = q * (scale * fp32(S / 127))`, as
    /// `host.dequantize_rows` computes it (the multiplier divided in double, then rounded to fp32).
    public func embed(_ ids: [Int]) throws -> (hidden: [Float], ple: [Float]) {
        (try dequantize(embed, embedScales, embedScale, ids), try dequantize(ple, pleScales, perLayerEmbedScale, ids))
    }

    private func dequantize(_ table: RowTable, _ scales: [Float], _ multiplier: Double, _ ids: [Int]) throws -> [Float] {
        let m = Float(multiplier / 127.0)
        var out = [Float]()
        out.reserveCapacity(ids.count * table.columns)
        for id in ids {
            try table.withRow(id) { row in
                let factor = scales[id] * m
                for q in row { out.append(Float(Int8(bitPattern: q)) * factor) }
            }
        }
        return out
    }

    /// Rows p0 ..< p0+T of a layer type's (cos, sin) tables, flattened; the caller keeps them inside the table.
    public func ropeRows(_ layerType: String, p0: Int, count: Int) -> (cos: [Float], sin: [Float])? {
        guard let pair = rope[layerType] else { return nil }
        return ((p0..<(p0 + count)).flatMap { pair.cos.row($0) }, (p0..<(p0 + count)).flatMap { pair.sin.row($0) })
    }
}
